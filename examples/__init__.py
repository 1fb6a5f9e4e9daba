"""Example training code for the orchestrator."""
