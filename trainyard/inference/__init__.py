"""Batch inference: a model reference and an input checked into a job (plan), read per
rank (inputs, readers), scored by torchrun workers (job) into exactly-once shards."""
