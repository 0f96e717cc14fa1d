"""The prompt cache's own room: snapshots of caches that cannot be cut back (snapshots) and the
disk tier under the in-memory caches (disk)."""
