"""Sweep the exactness self-check over transformers' decoder families; write their verdicts.

Each family (or variant: GQA, tied, sliding-window) is checked from a config of its own
transformers config class, shrunk to a tiny random model (``testing.shrink.tiny_config_of``),
on 4 gloo ranks at TP1/2 x PP1/2 plus the unit state through Split/Merge
(``proof.admission.check_family``). The verdicts go to ``benchmarks/results/model_families.json``, which
``benchmarks/family_table.py`` renders into the README's family table.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/family_sweep.py [model_type ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "model_families.json"

#: name -> (model_type, config overrides). GQA unless the family's defaults are MHA.
SWEEP: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 4}),
    "llama-tied": (
        "llama",
        {"num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": True},
    ),
    "llama-mha-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("mistral", {"num_attention_heads": 8, "num_key_value_heads": 4}),
    "mistral-sliding": (
        "mistral",
        {"num_attention_heads": 8, "num_key_value_heads": 4, "sliding_window": 64},
    ),
    "qwen2": ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 4}),
    "qwen3": ("qwen3", {"num_attention_heads": 8, "num_key_value_heads": 4}),
    "phi3": ("phi3", {"num_attention_heads": 8, "num_key_value_heads": 4}),
    "gemma": ("gemma", {"num_attention_heads": 8, "num_key_value_heads": 4}),
    "gemma2": ("gemma2", {"num_attention_heads": 8, "num_key_value_heads": 4}),
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "gemma3_text": ("gemma3_text", {}),
    "olmo": ("olmo", {}),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", {}),
    "granite": ("granite", {}),
    "cohere": ("cohere", {}),
    "cohere2": ("cohere2", {}),
    "starcoder2": ("starcoder2", {}),
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
    "stablelm": ("stablelm", {}),
    "phi": ("phi", {}),
    "nemotron": ("nemotron", {}),
    "exaone4": ("exaone4", {}),
    "smollm3": ("smollm3", {}),
    "seed_oss": ("seed_oss", {}),
    "ministral": ("ministral", {}),
    "arcee": ("arcee", {}),
    "apertus": ("apertus", {}),
    "helium": ("helium", {}),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {}),
    "ernie4_5": ("ernie4_5", {}),
    "vaultgemma": ("vaultgemma", {}),
    "bitnet": ("bitnet", {}),
    "mellum": ("mellum", {}),
    "cwm": ("cwm", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "olmoe": ("olmoe", {}),
    "granitemoe": ("granitemoe", {}),
    "phimoe": ("phimoe", {}),
    "glm4_moe": ("glm4_moe", {}),
    "dots1": ("dots1", {}),
    "gpt_oss": ("gpt_oss", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "falcon": ("falcon", {}),
    "gpt_neox": ("gpt_neox", {}),
}


def config_of(model_type: str, overrides: dict[str, Any]) -> Any:
    """The transformers config of ``model_type`` with ``overrides``, a causal LM."""
    import transformers as tf

    return tf.AutoConfig.for_model(model_type, **overrides)


def run(names: list[str]) -> dict[str, Any]:
    """Check ``names`` on one reused 4-rank pool (renewed after a failure); their verdicts and times."""
    from nereus_lightning.proof.admission import check_family
    from nereus_lightning.spec.families import FAMILIES
    from nereus_lightning.testing import WorkerPool

    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    pool = WorkerPool(4)
    try:
        for name in names:
            model_type, overrides = SWEEP[name]
            start = time.perf_counter()
            try:
                verdict = check_family(config_of(model_type, overrides), pool)
                entry = verdict.to_json()
            except Exception as exc:  # noqa: BLE001 - a config that cannot even be shrunk is refused
                entry = {
                    "model_type": model_type,
                    "layouts": {
                        "tiny": {
                            "exact": False,
                            "max_error": 0.0,
                            "reason": f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                        }
                    },
                }
            entry["seconds"] = round(time.perf_counter() - start, 1)
            entry["registered"] = model_type in FAMILIES
            results[name] = entry
            bad = [f"{k}: {v['reason']}" for k, v in entry["layouts"].items() if not v["exact"]]
            print(
                f"{name:18s} {entry['seconds']:6.1f}s  {'EXACT' if not bad else 'REFUSED ' + bad[0]}",
                flush=True,
            )
            if bad:  # a rank that failed alone may have broken the process group: start afresh
                pool.close()
                pool = WorkerPool(4)
    finally:
        pool.close()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(dict(sorted(results.items())), indent=1) + "\n")
    return results


if __name__ == "__main__":
    run(sys.argv[1:] or list(SWEEP))
