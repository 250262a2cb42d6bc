"""Trace-driven simulation of the controller: drift traces, a simulated machine, policies, reports.

Pure Python (no torch).
"""

from nereus_lightning.sim.experiment import Setup, make_setup, run_experiment
from nereus_lightning.sim.machine import TRUE_EFFICIENCY, TrueMachine
from nereus_lightning.sim.policies import POLICY_KINDS, PolicySpec, make_policy
from nereus_lightning.sim.report import format_table, plot_comparison, plot_gamma_sweep, write_csv
from nereus_lightning.sim.simulator import (
    Comparison,
    StepRecord,
    Summary,
    compare,
    gamma_sweep,
    simulate,
    summarise,
)
from nereus_lightning.sim.trace import (
    SPOT_TRACES,
    DriftTrace,
    build_trace,
    length_curve,
    long_trace,
    paper_trace,
)

__all__ = [
    "POLICY_KINDS",
    "SPOT_TRACES",
    "TRUE_EFFICIENCY",
    "Comparison",
    "DriftTrace",
    "PolicySpec",
    "Setup",
    "StepRecord",
    "Summary",
    "TrueMachine",
    "build_trace",
    "compare",
    "format_table",
    "gamma_sweep",
    "length_curve",
    "long_trace",
    "make_policy",
    "make_setup",
    "paper_trace",
    "plot_comparison",
    "plot_gamma_sweep",
    "run_experiment",
    "simulate",
    "summarise",
    "write_csv",
]
