"""Trainable adapters of zoomkv methods and the adapter artefact (see base.py for the contract)."""
