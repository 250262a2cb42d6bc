"""`nereus-simulate`: replay a drift trace through the real controller and compare policies."""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from nereus_lightning.cli._hydra import CONFIG_ROOT, to_dict
from nereus_lightning.sim.experiment import controller_config, make_setup, run_experiment, trace_from_config


def simulate_from_config(cfg: DictConfig | dict[str, Any]) -> dict[str, Any]:
    """Run the comparison a (resolved) simulate config describes; returns the result dict."""
    c = to_dict(cfg)
    machine = dict(c.get("machine") or {})
    setup = make_setup(c["model"], c["cluster"], c.get("workload"), **machine)
    trace = trace_from_config(c["trace"])
    return run_experiment(
        setup,
        trace,
        c["policies"],
        controller_config(c.get("controller")),
        out_dir=c.get("output_dir"),
        gammas=c.get("gamma_sweep"),
        plot=bool(c.get("plot", True)),
        notice=bool(c.get("notice", True)),
    )


@hydra.main(config_path=str(CONFIG_ROOT), config_name="simulate", version_base=None)
def _app(cfg: DictConfig) -> None:
    result = simulate_from_config(cfg)
    print(result["text"])
    if "gamma_sweep" in result:
        print("\ngamma sweep (Nereus):")
        for row in result["gamma_sweep"]:
            print(
                f"  gamma={row['gamma']:<6g} {row['mean_step_s']:9.2f} s/step  "
                f"{row['transitions']:3d} transitions"
            )
        print(f"best gamma: {result['best_gamma']:g}")
    print(f"\noutputs in {cfg.output_dir}")


def main() -> None:
    """Console entry point (Hydra parses the command line)."""
    _app()


if __name__ == "__main__":
    main()
