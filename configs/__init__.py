"""The presets (`--config default|tiny|gpu`): TOML files shipped as package data, so an
installed wheel has them too (engine/config.py reads them with importlib.resources)."""
