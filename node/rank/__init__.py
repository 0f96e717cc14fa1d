"""Rank plumbing: the group and its collectives (dist), rank 0's broadcast (share), the
launcher's watcher and the heartbeat (watchdog), device memory limits (memory), the links'
measurement (links)."""
