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
 * --new-root-on FD (crun sandboxes: dsec-rootfs --own-root passes FD through `crun run
 * --preserve-fds`): crun chrooted this process into the sandbox's first root, which leaves
 * the namespace with the host's tree (dsec_rootfs.c); the root that stays is a clone of
 * it. This process says it runs (one byte: the helper may then detach the host's tree), the
 * helper sends the clone's root over FD (SCM_RIGHTS), and this process chroots there,
 * says so with one byte, and re-executes itself from it (its binary, stdio and cwd then belong
 * to the root every other process of the sandbox sees). Nothing else could move its root
 * without pivot_root's walk over every task on the host. No root received: it exits 125.
 *
 * Build: gcc -static -O2 -Wall -Wextra -Werror -o dsec-init dsec_init.c
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static const char SELF[] = "/.dsec/dsec-init";

/* Chroot to the directory fd received on sock, acknowledge, re-exec from the new root. The
 * answer is one byte: '1', or the letter of the step that failed (dsec-rootfs reports it). */
static void take_root(int sock)
{
	char byte;
	char control[CMSG_SPACE(sizeof(int))];
	struct iovec iov = { .iov_base = &byte, .iov_len = 1 };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
			      .msg_controllen = sizeof(control) };
	struct cmsghdr *c;
	int root = -1, null = -1;
	const char *failed = NULL;

	/* Running: the helper may now detach the host's tree, which disconnects every mount under
	 * the first root (its /.dsec included: exec'ing from there would no longer work). */
	if (write(sock, "h", 1) != 1)
		_exit(125);
	if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) != 1)
		failed = "r";
	for (c = failed ? NULL : CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
			memcpy(&root, CMSG_DATA(c), sizeof(int));
	if (!failed && root < 0)
		failed = "f";
	if (!failed && (fchdir(root) != 0 || chroot(".") != 0 || chdir("/") != 0))
		failed = "c";
	if (!failed && (null = open("/dev/null", O_RDWR)) < 0)
		failed = "n";
	if (!failed && (dup2(null, 0) < 0 || dup2(null, 1) < 0 || dup2(null, 2) < 0))
		failed = "d";
	if (write(sock, failed ? failed : "1", 1) != 1 || failed)
		_exit(125);
	close(root);
	close(sock);
	if (null > 2)
		close(null);
	char *argv[] = { (char *)SELF, NULL };
	execv(SELF, argv);
	_exit(125);
}

static void nothing(int sig)
{
	(void)sig;
}

int main(int argc, char **argv)
{
	struct sigaction sa = { 0 };
	sigset_t all;

	if (argc == 3 && strcmp(argv[1], "--new-root-on") == 0)
		take_root(atoi(argv[2]));

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
