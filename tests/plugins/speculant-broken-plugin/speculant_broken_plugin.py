"""Test fixture: importing this plugin fails, as a plugin with a missing dependency would."""

raise RuntimeError("speculant-broken-plugin cannot be imported (on purpose)")
