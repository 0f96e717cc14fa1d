"""What a person does to a rig besides running a job: discover it, install, sync a model, check it
(doctor), measure it (bench).
"""
