"""Layer 6: launchers that start the coordinator and the workers."""
