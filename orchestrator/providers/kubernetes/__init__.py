"""The ``kubernetes`` provider: a training group as one JobSet per attempt (manifests.py)."""
