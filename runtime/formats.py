"""The version numbers of what the model cache holds. Imports nothing, so that the light modules
(the testbed's recipe, which ``ctrl --help`` reads) and the model builders share them."""

#: the embedded model's build recipe: bump when it changes (it names the cache directory and enters
#: the fingerprint)
EMBEDDED_VERSION = 1
