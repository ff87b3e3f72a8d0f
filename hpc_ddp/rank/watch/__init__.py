"""watch: noticing a failure (beats, a hang); only attempt/ imports it, to wire what it notices."""
