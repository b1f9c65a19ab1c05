"""Runs lm-eval's tasks on an evalkit engine: lm-eval's LM interface on an Engine (lm), the length budget
(budget), the tasks (tasks, task_index) and the few lm-eval internals evalkit needs (lm_eval_compat)."""
