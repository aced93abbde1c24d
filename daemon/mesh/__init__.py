"""The mesh: who the peers are, whether they are alive, what they and the links measure."""
