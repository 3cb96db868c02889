"""Software updates made inside a capsule (``update make``) and applied to users' capsules (``update apply``)."""
