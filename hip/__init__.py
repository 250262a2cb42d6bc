"""ROCm (hipified) copies of the pack/unpack kernel sources (a package so that wheels and editable installs carry them)."""
