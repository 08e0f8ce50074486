"""Reinforcement learning from verifiable rewards: rewards, group advantages, the policy
losses (GRPO, Dr. GRPO, DAPO, GSPO) and rollouts on the project's own engine. The objective
that ties them to the trainer is jaxpar/objectives/grpo.py."""
