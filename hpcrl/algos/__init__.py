"""RL algorithm pieces: policy and value losses, KL estimators (advantage estimators land here too)."""
