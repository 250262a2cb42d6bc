"""The end of ``fit``: no full model goes through one process unless ``write_back`` asks for it.

Every rank writes its own shards of the final checkpoint (DCP); with ``write_back=True`` the
caller's module receives the logical state (gathered from the EMUs on rank 0).
"""

from __future__ import annotations

import os

import pytest
import torch

from nereus_lightning.lightning.emu_state import EMUStates
from nereus_lightning.lightning.hf_export import logical_params
from tests.lightning.helpers import fit, small_task

pytestmark = pytest.mark.distributed


def _recording_write_back(monkeypatch, marker):  # noqa: ANN001, ANN202
    """``EMUStates.write_back`` that first notes the calling rank in
    ``marker`` (the forked ranks inherit it).
    """
    original = EMUStates.write_back

    def write_back(self, dst=None):  # noqa: ANN001, ANN202
        with open(marker, "a") as f:
            f.write(f"{torch.distributed.get_rank()}\n")
        return original(self, dst)

    monkeypatch.setattr(EMUStates, "write_back", write_back)


@pytest.mark.parametrize("write_back", [False, True])
def test_fit_gathers_the_models_into_the_caller_only_with_write_back(tmp_path, monkeypatch, write_back):
    from nereus_lightning.lightning import PPOModule

    marker = tmp_path / "write_back_calls"
    _recording_write_back(monkeypatch, marker)
    module = PPOModule(task=small_task(), prompts_per_step=8, seed=3)
    initial = {n: p.detach().clone() for n, p in module.actor.named_parameters()}
    fit(str(tmp_path), devices=2, max_steps=2, every=2, module=module, write_back=write_back)
    # The final checkpoint was written by the ranks (DCP shard files __<rank>_<i>.distcp) ...
    stage_dir = tmp_path / "ckpt" / "s2.ckpt" / "emu" / "actor_train"
    writers = {f.split("_")[2] for f in os.listdir(stage_dir) if f.endswith(".distcp")}
    assert writers == {"0", "1"}, sorted(os.listdir(stage_dir))
    trained = logical_params(str(stage_dir))
    after = dict(module.actor.named_parameters())
    assert any(not torch.equal(trained[n], initial[n]) for n in initial)  # training moved the weights
    if write_back:
        # ... and the caller's module holds the logical state, gathered once at the end.
        assert sorted(marker.read_text().split()) == ["0", "1"]
        assert all(torch.equal(after[n].detach(), trained[n]) for n in trained)
    else:
        # ... and nothing was gathered: the caller's module keeps the weights it started with.
        assert not marker.exists()
        assert all(torch.equal(after[n].detach(), initial[n]) for n in initial)


def test_the_compile_workers_shut_down_while_the_final_checkpoint_is_written(monkeypatch):
    """``on_train_end`` (before ModelCheckpoint's save) starts their shutdown on a thread; ``teardown``
    waits for it. Without inductor loaded there is nothing to shut down.
    """
    import sys
    import threading
    import types

    from nereus_lightning.lightning import NereusCallback

    trainer = types.SimpleNamespace(is_global_zero=True)
    monkeypatch.delitem(sys.modules, "torch._inductor.async_compile", raising=False)
    callback = NereusCallback()
    callback.on_train_end(trainer, None)
    callback.teardown(trainer, None, "fit")  # nothing started, nothing to wait for

    release, calls = threading.Event(), []

    def shutdown_compile_workers() -> None:
        calls.append(threading.current_thread().name)
        release.wait(10)

    fake = types.SimpleNamespace(shutdown_compile_workers=shutdown_compile_workers)
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", fake)
    callback.on_train_end(trainer, None)
    worker = callback._compile_workers
    assert worker is not None and worker.is_alive()  # the save would run now, beside it
    release.set()
    callback.teardown(trainer, None, "fit")
    assert not worker.is_alive() and calls == ["nereus-compile-workers"]
