"""Run-level programs: `swarm-coordinator` (bootstraps a run) and `swarm-local` (a whole swarm here)."""
