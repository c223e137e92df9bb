"""Rollout: worker loop, engine clients (sglang, hf), the hf engine server, routing."""
