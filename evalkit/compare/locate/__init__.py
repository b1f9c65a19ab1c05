"""``--locate``: every changed document explained at the token where it changed. why is the pure analysis (the
first divergent token, its class, both engines' alternatives); engines sets each run's engine up again from its
recorded config; passes runs them (the teacher-forced traces) and is what the command line calls."""

from evalkit.compare.locate.passes import add_arguments, from_args, locate, prompt_ids

__all__ = ["add_arguments", "from_args", "locate", "prompt_ids"]
