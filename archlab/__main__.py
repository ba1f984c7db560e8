from archlab.cli import main

main()
