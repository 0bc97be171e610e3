"""Integrations of the project's transfer methods into engines an operator already runs."""
