"""Hydra configs of nereus-train, nereus-plan and nereus-simulate (a package so that Hydra finds them in a wheel)."""
