/*
 * dsec-init: PID 1 of every container sandbox (bind-mounted read-only at /.dsec/dsec-init).
 *
 * One process that sleeps in sigwaitinfo(): on SIGCHLD it reaps every exited child (orphans
 * reparented to it included), on SIGTERM it exits 0 (the sandbox ends), every other signal is
 * taken and dropped. It needs nothing from the image (static), never exits on its own, and has
 * no pipe to the edge, so a sandbox survives an edge restart.
 *
 * It replaced `busybox sh -c 'while :; do sleep & wait; done'`, which was two processes (the
 * shell and its sleep) of ~0.4 MiB each on a node holding thousands of idle sandboxes.
 *
 * The handlers are empty and never run (everything is blocked): they exist because the kernel
 * drops a signal whose handler is SIG_DFL when it is sent to a pid namespace's init.
 *
 * Build: gcc -static -O2 -Wall -Wextra -Werror -o dsec-init dsec_init.c
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stddef.h>
#include <sys/wait.h>

static void nothing(int sig)
{
	(void)sig;
}

int main(void)
{
	struct sigaction sa = { 0 };
	sigset_t all;

	sigfillset(&all);
	sigprocmask(SIG_BLOCK, &all, NULL);
	sa.sa_handler = nothing;
	sigaction(SIGCHLD, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	for (;;) {
		int sig = sigwaitinfo(&all, NULL);
		if (sig == SIGTERM)
			return 0;
		if (sig == SIGCHLD)
			while (waitpid(-1, NULL, WNOHANG) > 0)
				;
	}
}
