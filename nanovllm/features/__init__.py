"""The engine's optional capabilities, each a layer of its own, imported only when a request, an
option or a checkpoint asks for it and entered through one named hook of the core (README.md's
"The path of one request" lists each layer and its hook)."""
