"""Shared test helpers and pytest plugins (fixtures): engines, gateways, stores, recorded runs."""
