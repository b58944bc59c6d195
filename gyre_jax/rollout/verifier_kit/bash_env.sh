# BASH_ENV of a gyre-jax verifier: records the commands that test.sh itself (the bash whose PID is
# GYRE_TEST_PID) ran and did not find, so that a verifier that could not run is excluded, never scored 0.
command_not_found_handle() {
  if [ -n "${GYRE_TEST_PID:-}" ] && [ "$$" = "$GYRE_TEST_PID" ] && [ -n "${GYRE_LOGS:-}" ]; then
    printf '%s\n' "$1" >> "$GYRE_LOGS/.gyre-missing" 2>/dev/null
  fi
  printf 'bash: %s: command not found\n' "$1" >&2
  return 127
}
