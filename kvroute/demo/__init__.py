"""``kvroute demo``: a self-contained comparison of routing policies on sim workers."""
