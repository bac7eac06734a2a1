"""The Tinker-compatible training service, job side (see ``issues`` 24 and README): the wire format
(:mod:`.wire`); more modules come with the service."""
