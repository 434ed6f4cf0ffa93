"""Test helpers shipped with tieredkv: the tier contract suite, a fault-injecting wrapper,
and managers for local redis-server / Redis Cluster processes."""
