"""Controller policy, reward, GRPO and evaluation; lands with issue #4."""
