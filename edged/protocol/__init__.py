"""Wire formats shared by the transports."""
