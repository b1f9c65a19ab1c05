"""evalkit's Hydra launcher on Ray: ``python -m evalkit -m hydra/launcher=evalkit_ray ...`` runs each point of a
sweep as a Ray task holding the devices the point needs, so Ray runs as many at once as the machine (or cluster)
holds. Hydra finds it here, in the ``hydra_plugins`` namespace package; Ray is imported only when it launches."""
