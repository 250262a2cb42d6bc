"""CUDA sources of the fused pack/unpack kernels (a package so that wheels and editable installs carry them)."""
