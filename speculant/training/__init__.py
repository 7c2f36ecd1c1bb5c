"""Training: a small target on Python source, and drafters (DFlash first) against any local target.

Every trainer takes target features exactly as inference does (the backend's hidden-state
capture), saves in the published on-disk formats, resumes from its last checkpoint, and is
seeded.
"""
