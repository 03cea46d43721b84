"""Worker-side roles: the Megatron actor/reference/critic (and the rollout engine as it lands)."""
