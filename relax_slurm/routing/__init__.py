"""Rollout routing replay (R3) for mixture-of-experts models: which experts the engine routed
each token to (`shape`: reading a model's MoE layout, the wire format) and the trainer's hooks
that record, compare and replay those choices (`hooks`, torch)."""
