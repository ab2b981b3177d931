"""Batch-size optimization for recurring jobs: the policy, its trace simulator, the client."""
