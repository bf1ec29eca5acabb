"""Prefect tasks: thin wrappers that load a config section, call one `slime` stage function and
return artifact URIs with manifest hashes. No ML logic lives here. Tasks arrive with the stages."""
