"""Plain data and logic, shared by the launcher and the ranks (node/ imports these): the job spec,
the events, hostfiles, model checks and shard plans. No I/O but reading a file.
"""
