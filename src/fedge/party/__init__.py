"""The party side of federated training: what a station (or a simulated party) runs.

``dataset`` (the station's kept images and labels) and ``preprocess`` need no torch and
are used by the inference-only agent; ``families``, ``trainer`` and ``station_app`` (the
Flower ClientApp a station's SuperNode runs) are the training side.
"""
