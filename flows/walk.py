"""What a walk of the DAG reaches, answered from the config alone.

Nothing here imports a stage (their imports bring torch and transformers, about 18 s on 2 cores
before their ``.pyc`` files exist): ``flywheel run`` asks before it imports them, to know whether
a check that needs them is still to come (``flows.flywheel.check_run``).
"""

from __future__ import annotations

from typing import Any

# The stages of a round that run before splice (a walk stopped at one of them in round 1
# never splices).
BEFORE_SPLICE = ("explore", "pareto", "reflect", "mcts")


def splices(cfg: Any, rounds: int, stop_at: tuple[str, int] | None = None) -> bool:
    """Whether a walk of ``rounds`` rounds (stopped at ``stop_at``) reaches a splice stage."""
    if rounds < 1 or "mcts" not in cfg.iteration.data:
        return False
    if stop_at is None:
        return True
    name, round = stop_at
    return round >= 2 or round == 1 and name not in BEFORE_SPLICE
