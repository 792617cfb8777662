"""Stand-ins for the serving engines, written from their upstream source (see each
module's docstring for the file and commit or release): the module paths, classes,
signatures and attributes the adapters read, the call sequences the engines make, and
production numerics computed by code written here from the engines' algorithms, never by
the hooks' own `numerics`, so a wrong shadow or a wrong slice fails a test."""
