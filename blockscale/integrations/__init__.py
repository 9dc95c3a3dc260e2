"""integrations/: adapters to trainers blockscale does not own, built only from nn/ and
distributed/ (and the recipe registry). Optional and thin: nothing in blockscale imports them,
and each imports its trainer only when it is itself imported.

- `integrations.titan`: torchtitan's converters (0.3.x: `titan.v0_3`; 0.2.2: `titan.v0_2`).
"""
