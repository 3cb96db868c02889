"""What a host does for its peers, without HTTP: serve its sealed objects (HCP LOOKUP, READ-HASH,
READ) and receive pushed ones (manifest parts, blocks, commit). The agent's routes are a thin shell
over these; tests drive them directly on a store."""
