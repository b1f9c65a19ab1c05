"""Stage 3, the harness: lm-eval's LM interface on an Engine (lm), the length budget (budget) and the tasks
(tasks, task_index)."""
