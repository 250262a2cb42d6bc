"""nereus-check-model configs (its own root, like nereus-plan's)."""
