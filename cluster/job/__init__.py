"""Running one job: each rank's environment, starting and watching the rank processes (here or over
SSH), and the bookkeeping of their events.
"""
