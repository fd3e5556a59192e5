"""One manager's shard: the LMDB store, Dragon's checkpoint rules, and the manager serving them."""
