"""nereus-plan configs (its own root: its model/cluster/workload groups stay out of the other apps)."""
