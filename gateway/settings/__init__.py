"""Settings: the setting groups, how they load (file, env, flags), per-arm and policy options."""
