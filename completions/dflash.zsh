
#compdef dflash

_dflash_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _DFLASH_COMPLETE=complete_zsh dflash)
}

compdef _dflash_completion dflash

